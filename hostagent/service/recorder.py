"""One journald record per transition, in plain words, with stable fields.

Each phase change of the lendee and each new intent becomes one record
(``HOSTAGENT_EVENT``, ``_VM``, ``_FROM``, ``_TO``, ``_DURATION_MS``, ``_RESULT``,
``_HOLDERS``...) and one update for the control clients that follow progress.
"""

from __future__ import annotations

import hostagent
from hostagent.core import clock, levers, machine
from hostagent.host import journal
from hostagent.core.model import (
    DrainFailed,
    Event,
    GpuPods,
    GpusDetached,
    Intent,
    IntentSource,
    Observed,
    Phase,
    Policy,
    Regrow,
    RelendDue,
    State,
    Topology,
)
from hostagent.service.parts import Progress, View


class Recorder:
    """Journal records of the transitions of `view`'s state, told to `progress` too."""

    def __init__(self, topo: Topology, policy: Policy, view: View, progress: Progress,
                 stop: levers.Stop = levers.Stop.SHUTDOWN) -> None:
        self.topo, self.policy, self.view, self.progress = topo, policy, view, progress
        self.stop = stop  # drain.stop: how STOPPING ends, said when it begins
        self.lendee = topo.lendee

    def phase(self, old: State, new: State, event: Event) -> None:
        """The lendee's phase changed (the view's `phase_since` is still the old one's)."""
        took = (clock.now() - self.view.phase_since) * 1000
        lendee, gpus = self.lendee, self.topo.gpu_names(new.lent)
        # What the lendee held: an agent that starts from a state lending nothing yet and
        # finds the lendee running (a reclaim it resumes) reads it in the new state.
        had = old.lent or new.lent
        wanting = [o for o in new.waiting_owners if self.topo.claims(o) & had]
        wanted = self.topo.whole(self.topo.gpus_of(wanting)) & had
        who = ", ".join(wanting) or ("hostagent reclaim" if new.reclaiming else "an owner VM")
        draining = f"{who} wants {self.topo.gpu_names(wanted or had)}: draining {lendee}"
        if isinstance(event, RelendDue | GpuPods):
            freed = machine.free_gpus(new, self.topo, self.policy) - old.lent
            more = self.topo.gpu_names(freed)
            limit = self.policy.regrow_max_wait
            pods = "an unknown number of" if old.gpu_pods is None else old.gpu_pods
            if self.policy.regrow is Regrow.ALWAYS:
                why = "policy.regrow = always"
            elif isinstance(event, RelendDue) and old.regrow_waiting and old.gpu_pods != 0:
                why = (f"{pods} pod(s) on its node still request a GPU after "
                       f"policy.regrow_max_wait ({limit:g}s): they start over")
            else:
                why = "no pod on its node requests a GPU (policy.regrow = when-idle)"
            verb, them = ("is", "it") if len(freed) == 1 else ("are", "them")
            draining = f"{more} {verb} free again and {why}: restarting {lendee} to add {them}"
        held = self.topo.lendee_gpus - new.lent
        others = f" ({self.topo.gpu_names(held)} not lent)" if held and new.lent else ""
        returning = f"{lendee}'s guest agent answered: returning it to the cluster"
        if isinstance(event, GpusDetached):
            starting = ", ".join(o for o in new.waiting_owners
                                 if self.topo.claims(o) & event.gpus) or "nobody now"
            returning = (f"{self.topo.gpu_names(event.gpus)} detached from {lendee} while it "
                         f"runs, for {starting}: its node is verified with {gpus} and "
                         "uncordoned")
        if old.regrowing and new.phase in (Phase.BOOTING, Phase.JOINING):
            why, then = "it would gain no GPU now", ""
            if isinstance(event, DrainFailed):
                why = f"its node could not be drained ({event.reason})"
                then = (f"; tried again in {self.policy.relend_delay:g}s "
                        "(policy.relend_delay)")
            returning = (f"the restart of {lendee} for more GPUs is given up: {why}; it goes "
                         f"back to the cluster with {gpus} as it is{then}")
        messages = {
            Phase.BOOTING: returning if old.regrowing else
            f"{lendee} is running with {gpus}: waiting for its guest agent",
            Phase.JOINING: returning,
            Phase.LENT: f"{lendee} is lent: {gpus} are the cluster's{others}",
            Phase.DRAINING: draining,
            Phase.STOPPING: f"{lendee} is drained: shutting it down through its guest agent "
                            "once the agent answers" if self.stop is levers.Stop.SHUTDOWN else
                            f"{lendee} is drained: powering it off once its guest agent answers "
                            "and has frozen its filesystems (drain.stop = \"power-off\"; its "
                            "own shutdown if the drain left pods)",
            Phase.OFF: f"{lendee} is off: its GPUs are free",
            Phase.FAILED: f"{lendee} needs attention: {new.reason}",
        }
        adopted = isinstance(event, Observed) and new.phase is Phase.LENT
        if adopted:
            messages[Phase.LENT] = (f"{lendee} runs lent with {gpus}{others}, its node in "
                                    "service as the last lend left it: adopted as it is")
        failed = new.phase is Phase.FAILED
        journal.record("phase", messages[new.phase], vm=lendee, from_=old.phase.value,
                       to=new.phase.value, duration_ms=took, cause=type(event).__name__,
                       result="failed" if failed else "adopted" if adopted else "ok",
                       holders=self.holders(),
                       priority=journal.Priority.ERR if failed else journal.Priority.INFO)
        self.progress.publish("phase", messages[new.phase], {"vm": lendee,
                                                             "from": old.phase.value,
                                                             "to": new.phase.value})

    def holders(self) -> str:
        """HOSTAGENT_HOLDERS: who holds each GPU after this transition, for `history`."""
        return ",".join(f"{gpu}={vm or '-'}" for gpu, vm in
                        machine.holders(self.view.state, self.topo).items())

    def regrow_waits(self, new: State) -> None:
        """A regrow is due but waits: pods on the node use a GPU (policy.regrow)."""
        freed = machine.free_gpus(new, self.topo, self.policy) - new.lent
        limit = self.policy.regrow_max_wait
        bound = "" if limit is None else (
            f", or in {limit:g}s with them (policy.regrow_max_wait)")
        pods = "an unknown number of" if new.gpu_pods is None else new.gpu_pods
        journal.record("regrow", f"{self.lendee} could take {self.topo.gpu_names(freed)} too, "
                       f"but {pods} pod(s) on its node request a GPU: it restarts "
                       f"once none does (policy.regrow = when-idle){bound}",
                       vm=self.lendee, result="waiting")

    def intent(self, intent: Intent) -> None:
        shared = self.topo.claims(intent.owner) & self.view.state.lent
        how = {IntentSource.HOOK: "through libvirt", IntentSource.CONTROL: "by hostagent play",
               IntentSource.RESUME: "before the agent restarted"}[intent.source]
        if not shared:
            journal.record("intent", f"{intent.owner} asked to start {how}: its GPUs are "
                           f"free, starting it", vm=intent.owner, to="pending", result="ok",
                           intent=intent.id)
            self.progress.publish("intent",
                                  f"{intent.owner} asked to start ({intent.source.value})",
                                  {"vm": intent.owner, "intent": intent.id, "to": "pending"})
            return
        names = self.topo.gpu_names(shared)
        journal.record("intent", f"{intent.owner} asked to start {how}: "
                       f"{names} {'are' if len(shared) > 1 else 'is'} lent to "
                       f"{self.lendee}; {intent.owner} will start by itself once "
                       f"{'they are' if len(shared) > 1 else 'it is'} free",
                       vm=intent.owner, to="pending", result="deferred", intent=intent.id)
        self.progress.publish("intent", f"{intent.owner} asked to start ({intent.source.value})",
                              {"vm": intent.owner, "intent": intent.id, "to": "pending"})

    def running_line(self, status: str | None = None) -> str:
        """The agent's start record: which hostagent runs (an upgrade shows), and how
        (`status`: every lendee's, where several lend; default: this one's)."""
        return f"hostagent {hostagent.version()} is running: {status or self.status_line()}"

    def status_line(self) -> str:
        pending = ", ".join(self.view.state.waiting_owners)
        return f"{self.lendee} {self.view.state.phase.value}" + (f"; waiting: {pending}"
                                                            if pending else "")
