"""The peer checkpoint tier on the node: the partner's copies this node keeps, its
pushes to the partner and its fetches back, the data channel and their routes."""
