"""Multi-rank deployments: AFD (attention and expert ranks apart) and the colocated DP+EP baseline."""
