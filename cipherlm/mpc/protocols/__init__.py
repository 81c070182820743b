"""OT-based two-party protocols (CrypTFlow2, SiRNN, BLB appendix C), one per module.

Each is written once, parameterised by ``ctx.party``, vectorised over numpy
shapes; costs per element are listed in each docstring and measured in
docs/mpc.md.
"""
