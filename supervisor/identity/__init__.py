"""Who a host monitor is: the credentials agents present, and the node each may speak for.

`node_keys` derives and checks per-node credentials (HMAC of the node name);
`authenticator` turns an Authorization header into the node it speaks for, with the
shared agent token, node keys and, through the `TokenReviewer` interface, Kubernetes
service account tokens (reviewed by supervisor/kube/token_review.py).
"""
