"""Benchmarks. Each module has ``run(model, tokenizer, settings)``, its settings a dataclass of
``bench.settings``; run them as ``kvsieve bench NAME [OPTIONS]`` or ``python benchmarks/NAME.py
[OPTIONS]``. Every figure is a ratio measured in the same run (compressed vs full cache), written
to JSON (and a PNG where it is a curve).

* ``engine``    tokens/s and peak KV bytes of bounded caches vs full (the engine's headline)
* ``overhead``  per-step cost of every policy vs full at the same live cache length
* ``memory``    peak allocated KV bytes as generation grows (bounded methods stay flat)
* ``throughput`` largest batch under a KV memory limit and total tokens/s there, vs full
* ``long``      tokens/s of full vs bounded methods over long generations
* ``grouping``  what SkipKV's batch grouping by prefill length changes in kvsieve
* ``compiled``  the compiled decode step vs eager, and vs transformers' generate (eager and static compiled)
"""
