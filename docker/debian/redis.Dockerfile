# Redis from Debian bookworm's redis-server (redis-cli included), for docker/compose.cpu.yml's REDIS_IMAGE.
# Like the public redis image: `redis-server ...` as the command, run as user redis in /data (its AOF goes there).
ARG BASE_IMAGE=sparecycles-debian:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin \
    && mkdir -p /data && chown redis:redis /data
WORKDIR /data
USER redis
CMD ["redis-server"]
