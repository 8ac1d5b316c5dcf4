"""Reading one backend: HTTP calls (`client`), one round of read-decide-probe
(`monitor`), and `llm-health check`'s loop of rounds (`check`)."""
