"""partc's version: the one source setup.cfg, plan.yaml, profiles and `partc --version` read."""

__version__ = "0.1.0"
