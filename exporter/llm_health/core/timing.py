"""The timing defaults the exporter, `check`, the restarter's re-verification and the HTTP
client share, in one place: how often a backend is read, how long each read may take, and
how long no progress must last before a hang. Each is the default of the configuration
key of that name (`global:` of the exporter's file, `verify:` of the restarter's, the
flags of `check`); another value is set there, never as a number in a module."""

INTERVAL_S = 10.0  # one round: /metrics (and /v1/models) read once
HUNG_AFTER_S = 60.0  # no progress with work in flight this long (and two rounds) is hung
PROBE_INTERVAL_S = 60.0  # an idle engine's 1-token probe, at most this often
PROBE_TIMEOUT_S = 5.0  # the probe's answer
CONNECT_TIMEOUT_S = 3.0  # any connection to a backend
METRICS_TIMEOUT_S = 30.0  # a /metrics read: a busy engine answers it late, never a hang alone
MODELS_TIMEOUT_S = 10.0  # /v1/models, the liveness read beside /metrics
