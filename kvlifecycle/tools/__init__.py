"""Tools beside the library: the demo, the benchmarks, the doctor, the P/D proxy and the SGLang driver.

None of this is the core: these modules are the one place (with :mod:`kvlifecycle.cli`) that wires transports
and adapters in, each lazily inside the function that needs them. The CLI verbs of the same names run them.
"""
