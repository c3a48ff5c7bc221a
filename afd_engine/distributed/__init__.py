"""Multi-rank deployments: AFD (attention and FFN ranks apart) and the colocated DP+EP baseline."""
