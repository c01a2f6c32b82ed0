"""The OpGraph: partc's graph IR, one node per operator of the exported program.

Plain data (dataclasses of ints, strings and tuples, JSON round-trip) that every later pass reads;
built by partc.frontend, priced by partc.cost, cut by partc.solve. `module_summary` groups it by
module for `partc inspect`. Imports no torch.
"""
