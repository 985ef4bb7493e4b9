"""gRPC serving plumbing every service shares: server, health, stop, TLS, ports, the model thread, statuses. No torch."""
