"""The environment variables a worker process is started with and reads: the host
monitor and the supervisor set them, the training side reads them. Each name is written
here once. Imports nothing from supervisor, host_monitor or training.
"""

from __future__ import annotations

#: The worker's global and node-local rank (torchrun's names).
RANK = "RANK"
LOCAL_RANK = "LOCAL_RANK"
#: Where the worker reaches its node's host monitor, and the bearer token it sends.
HOST_MONITOR_URL = "HOST_MONITOR_URL"
HOST_MONITOR_WORKER_TOKEN = "HOST_MONITOR_WORKER_TOKEN"
#: The host monitor's TLS: the CA bundle that verifies it, and the name its certificate is
#: checked against instead of the URL's host.
HOST_MONITOR_CA_FILE = "HOST_MONITOR_CA_FILE"
HOST_MONITOR_SERVER_NAME = "HOST_MONITOR_SERVER_NAME"
#: The file that holds the id of the emergency checkpoint the worker is signalled for.
HOST_MONITOR_REQUEST_FILE = "HOST_MONITOR_REQUEST_FILE"
#: The job the worker belongs to (a spare host monitor learns its job from it).
HOST_MONITOR_JOB = "HOST_MONITOR_JOB"
#: The torch.distributed world the worker starts in (the job's attempt).
WORKLOAD_ATTEMPT = "WORKLOAD_ATTEMPT"
#: What the worker runs in, once: on Kubernetes its pod's UID (the downward API).
POD_UID = "POD_UID"
#: Seconds a rank trains on after the supervisor last answered its host monitor
#: (training/monitor_link/lease.py); 0: no lease.
HOST_LEASE_S = "HOST_LEASE_S"
#: The checkpoint tiers' directories and the durable tier's URL.
CHECKPOINT_RAM_DIR = "CHECKPOINT_RAM_DIR"
CHECKPOINT_DURABLE_DIR = "CHECKPOINT_DURABLE_DIR"
CHECKPOINT_DURABLE_URL = "CHECKPOINT_DURABLE_URL"
#: torchrun's: how many ranks the job's world has.
WORLD_SIZE = "WORLD_SIZE"
#: The NumPy demo workload's (training/numpy_workload), set by the local cluster: the
#: job's shape, its run folder, its tiers' folders and where it writes what it trained.
NUM_DP_REPLICAS = "NUM_DP_REPLICAS"
NUM_NODES_PER_DP = "NUM_NODES_PER_DP"
RUN_DIR = "RUN_DIR"
LOCAL_CKPT_DIR = "LOCAL_CKPT_DIR"
DURABLE_CKPT_DIR = "DURABLE_CKPT_DIR"
OUTPUT_DIR = "OUTPUT_DIR"
#: `0` (or false, no, off): no automatic step count in the worker (training.auto_progress);
#: `supervisor run --no-auto-progress` and training.pod_launch honour it too.
AUTO_PROGRESS = "RESILIENCY_AUTO_PROGRESS"
