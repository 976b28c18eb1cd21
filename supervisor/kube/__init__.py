"""The Kubernetes side of the supervisor: API client, discovery, backend, sensing, leader
election. Nothing outside this package imports the `kubernetes` client."""
