# nginx deciding admission itself (its Lua module, Debian 12's packages) with llm-health to
# write the door's plan from gate.yml at start. Built from the repository root:
#   docker build -f compose/nginx-lua.Dockerfile -t llm-health-nginx-lua .
FROM python:3.11-slim

RUN apt-get update \
    && apt-get install -y --no-install-recommends libnginx-mod-http-lua lua-nginx-redis \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY exporter ./exporter
RUN pip install --no-cache-dir . && rm -rf /src

WORKDIR /
USER nobody
EXPOSE 8080
# The plan first (the gate's file, validated as the gate validates it), then nginx in the
# foreground; a bad gate.yml stops the container with the parser's message.
ENTRYPOINT ["/bin/sh", "-c", "llm-health nginx-lua --config.file /etc/llm-health/gate.yml --out /tmp/llm-health && exec nginx -c /etc/nginx/llm-health-lua.conf"]
