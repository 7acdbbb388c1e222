// labkube: the lab's Kubernetes control plane in one program, built from the sources of
// one release (go.mod: k8s.io/kubernetes v1.35.4 and etcd as that release requires it).
//
// Like hyperkube, the first argument (or the name it is called by, for a `kubectl`
// link) picks the component, and the rest are that component's own flags:
//
//	labkube etcd --data-dir DIR ...                  etcd's own main (etcdmain)
//	labkube kube-apiserver --etcd-servers URL ...    cmd/kube-apiserver
//	labkube kube-controller-manager ...              cmd/kube-controller-manager
//	labkube kube-scheduler ...                       cmd/kube-scheduler
//	labkube kubectl get nodes                        cmd/kubectl
//	labkube certs DIR                                the lab's CA, serving cert, SA keys
//	labkube client-cert DIR NAME CN [ORG...]         a client certificate from that CA
//
// One program shares one compile and one link between the five.
package main

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
	_ "time/tzdata" // as cmd/kube-apiserver: time zones for CronJobs

	"github.com/spf13/cobra"
	"go.etcd.io/etcd/server/v3/etcdmain"
	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	kubectl "k8s.io/kubectl/pkg/cmd"
	"k8s.io/kubectl/pkg/cmd/util"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
)

func main() {
	args := os.Args[1:]
	name := filepath.Base(os.Args[0])
	if name == "labkube" || name == "controlplane" {
		if len(args) == 0 {
			fmt.Fprintln(os.Stderr, "usage: labkube etcd|kube-apiserver|kube-controller-manager|"+
				"kube-scheduler|kubectl|certs|client-cert ARGS...")
			os.Exit(2)
		}
		name, args = args[0], args[1:]
	}
	switch name {
	case "etcd":
		etcdmain.Main(append([]string{"etcd"}, args...))
	case "kube-apiserver":
		run(apiserver.NewAPIServerCommand(), args)
	case "kube-controller-manager":
		run(controllermanager.NewControllerManagerCommand(), args)
	case "kube-scheduler":
		run(scheduler.NewSchedulerCommand(), args)
	case "kubectl":
		command := kubectl.NewDefaultKubectlCommand()
		command.SetArgs(args)
		if err := cli.RunNoErrOutput(command); err != nil {
			util.CheckErr(err)
		}
	case "certs":
		exit(certs(args))
	case "client-cert":
		exit(clientCert(args))
	default:
		fmt.Fprintf(os.Stderr, "labkube: no component %q\n", name)
		os.Exit(2)
	}
}

func run(command *cobra.Command, args []string) {
	command.SetArgs(args)
	os.Exit(cli.Run(command))
}

func exit(err error) {
	if err != nil {
		fmt.Fprintf(os.Stderr, "labkube: %v\n", err)
		os.Exit(1)
	}
}

// certs DIR: ca.crt/ca.key, apiserver.crt/.key for loopback and the in-cluster names,
// sa.key/sa.pub for service account tokens. ECDSA P-256 throughout: fast to make.
func certs(args []string) error {
	if len(args) != 1 {
		return fmt.Errorf("usage: certs DIR")
	}
	dir := args[0]
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	now := time.Now()
	ca := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "hostagent-lab-ca"},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(10 * 365 * 24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, ca, ca, &caKey.PublicKey, caKey)
	if err != nil {
		return err
	}
	if err := write(dir, "ca", der, caKey); err != nil {
		return err
	}
	serving := &x509.Certificate{
		SerialNumber: big.NewInt(2),
		Subject:      pkix.Name{CommonName: "kube-apiserver"},
		DNSNames: []string{"localhost", "kubernetes", "kubernetes.default",
			"kubernetes.default.svc", "kubernetes.default.svc.cluster.local"},
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1"), net.ParseIP("::1"),
			net.ParseIP("10.0.0.1")},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	if err := sign(dir, "apiserver", serving, ca, caKey); err != nil {
		return err
	}
	saKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	private, err := x509.MarshalPKCS8PrivateKey(saKey)
	if err != nil {
		return err
	}
	public, err := x509.MarshalPKIXPublicKey(&saKey.PublicKey)
	if err != nil {
		return err
	}
	if err := pemFile(filepath.Join(dir, "sa.key"), "PRIVATE KEY", private); err != nil {
		return err
	}
	return pemFile(filepath.Join(dir, "sa.pub"), "PUBLIC KEY", public)
}

// client-cert DIR NAME CN [ORG...]: NAME.crt/NAME.key for user CN in groups ORG.
func clientCert(args []string) error {
	if len(args) < 3 {
		return fmt.Errorf("usage: client-cert DIR NAME CN [ORG...]")
	}
	dir, name := args[0], args[1]
	ca, caKey, err := load(dir)
	if err != nil {
		return err
	}
	serial, err := rand.Int(rand.Reader, big.NewInt(1<<62))
	if err != nil {
		return err
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: args[2], Organization: args[3:]},
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	return sign(dir, name, tmpl, ca, caKey)
}

func sign(dir, name string, tmpl, ca *x509.Certificate, caKey *ecdsa.PrivateKey) error {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	tmpl.NotBefore = time.Now().Add(-time.Hour)
	tmpl.NotAfter = time.Now().Add(10 * 365 * 24 * time.Hour)
	tmpl.KeyUsage = x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		return err
	}
	return write(dir, name, der, key)
}

func write(dir, name string, der []byte, key *ecdsa.PrivateKey) error {
	private, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return err
	}
	if err := pemFile(filepath.Join(dir, name+".crt"), "CERTIFICATE", der); err != nil {
		return err
	}
	return pemFile(filepath.Join(dir, name+".key"), "EC PRIVATE KEY", private)
}

func load(dir string) (*x509.Certificate, *ecdsa.PrivateKey, error) {
	certPEM, err := os.ReadFile(filepath.Join(dir, "ca.crt"))
	if err != nil {
		return nil, nil, err
	}
	keyPEM, err := os.ReadFile(filepath.Join(dir, "ca.key"))
	if err != nil {
		return nil, nil, err
	}
	certBlock, _ := pem.Decode(certPEM)
	keyBlock, _ := pem.Decode(keyPEM)
	if certBlock == nil || keyBlock == nil {
		return nil, nil, fmt.Errorf("%s: ca.crt or ca.key is not PEM", dir)
	}
	cert, err := x509.ParseCertificate(certBlock.Bytes)
	if err != nil {
		return nil, nil, err
	}
	key, err := x509.ParseECPrivateKey(keyBlock.Bytes)
	return cert, key, err
}

func pemFile(path, kind string, der []byte) error {
	return os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: kind, Bytes: der}), 0o600)
}
