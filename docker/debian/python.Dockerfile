# Python 3.11 from Debian bookworm in a venv on PATH: `python` and `pip` as the public python:3.11-slim image has
# them (docker/Dockerfile's BASE_IMAGE contract). tools/images.sh builds it on its debootstrap base.
ARG BASE_IMAGE=sparecycles-debian:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv passwd \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8
CMD ["python"]
