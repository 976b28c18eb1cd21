# syntax=docker/dockerfile:1
# One image, two commands: `supervisor serve` (the default) and `host-monitor`.
#   docker build -t resiliency-supervisor:0.1.0 .
#   docker run --rm -p 8080:8080 resiliency-supervisor:0.1.0
#   docker run --rm resiliency-supervisor:0.1.0 host-monitor --help
# The base is pinned to an exact Python release (3.11, as the project) on Debian 12; pin
# it by digest too where your registry policy asks for it:
#   --build-arg PYTHON_IMAGE=python:3.11.14-slim-bookworm@sha256:<digest>
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

# --- build: install the package and its dependencies into a virtual environment -------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml README.md ./
COPY supervisor ./supervisor
COPY host_monitor ./host_monitor
COPY policies ./policies
COPY training ./training
COPY resiliency_protocol ./resiliency_protocol
# A regular (not editable) install: the runtime stage gets /opt/venv and no source tree.
# Byte-code is compiled here because the root filesystem is read-only at run time. The
# `demo` extra (NumPy) is for the demo workload the compose stack and the example JobSet
# run; the supervisor itself does not need it. An image for the PyTorch example JobSet
# adds the `torch` extra (with the torch build of your accelerators' index):
#   docker build --build-arg EXTRAS=demo,torch -t resiliency-supervisor-torch:0.1.0 .
ARG EXTRAS=demo
RUN /opt/venv/bin/pip install ".[${EXTRAS}]" \
 && /opt/venv/bin/python -m compileall -q /opt/venv/lib

# --- runtime: the virtual environment and a non-root user, nothing else ----------------
FROM ${PYTHON_IMAGE} AS runtime
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN groupadd --system --gid 10001 supervisor \
 && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/resiliency-supervisor \
      --no-create-home --shell /usr/sbin/nologin supervisor \
 && install -d -o 10001 -g 10001 /var/lib/resiliency-supervisor
COPY --from=build /opt/venv /opt/venv
WORKDIR /var/lib/resiliency-supervisor
# Numeric, so Kubernetes can check runAsNonRoot without reading /etc/passwd.
USER 10001:10001
# 8080: the supervisor's API. 9400: a host monitor's local API.
EXPOSE 8080 9400
CMD ["supervisor", "serve", "--host", "0.0.0.0", "--port", "8080"]
