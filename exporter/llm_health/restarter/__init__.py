"""`llm-health restarter`: the restart authority, an Alertmanager webhook receiver
(`app`) that runs restart commands without a shell (`runner`)."""
