"""What people and programs talk to: hook and control sockets, SSH, MQTT, metrics, history."""
