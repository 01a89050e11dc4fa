"""Test and demo support: tiny models built from a config (:mod:`.tiny_models`) and a harness that drives
lmdeploy's speculative agent directly (:mod:`.harness`). Used by the tests, the benchmarks, the CPU path's model
names and the ``check``/``demo`` commands; nothing of the core or of the series tooling imports it."""
