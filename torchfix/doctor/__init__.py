"""What shows the hazards: the scenario kit the fixes' scenarios are made of (``scenarios``), the self-test that
runs them (``selftest``), the soak (``stress``) and the watcher of shared state (``watch``).

Only ``scenarios`` is imported by ``import torchfix`` (each fix declares its scenarios); the rest runs on demand.
"""
