"""pnyx: decentralized RL post-training over an object store.

Importing the package is cheap: nothing heavy (torch, transformers) is imported here, so `pnyx --help`
stays instant. Heavy modules import their dependencies themselves.
"""

__version__ = "0.1.0"
