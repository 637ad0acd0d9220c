# Prometheus from Debian bookworm's prometheus package, for docker/compose.cpu.yml's PROMETHEUS_IMAGE. Like the
# public prom/prometheus image: the binary is the entrypoint, its TSDB in /prometheus, run as user prometheus.
ARG BASE_IMAGE=sparecycles-debian:bookworm
FROM ${BASE_IMAGE}
# libjs-moment-timezone (218 MB, the classic web UI's time-zone tables; Debian's prometheus depends on it) is
# dropped: the HTTP API, the scrapes and the rules never load it.
RUN apt-get update && apt-get install -y --no-install-recommends prometheus \
    && dpkg --purge --force-depends libjs-moment-timezone \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin \
    && mkdir -p /prometheus && chown prometheus:prometheus /prometheus
WORKDIR /prometheus
USER prometheus
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
