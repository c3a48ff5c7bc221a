"""Expert load balancing: where the copies of hot experts go (placement.py)."""
