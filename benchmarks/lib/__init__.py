"""What the benchmarks share: servers started on a free port and stopped (server), request
datasets (datasets, structured_schemas), result files stamped with where and when they were
measured (results), and the parts of the comparison with vLLM (peer_servers, load_levels,
greedy_agreement)."""
