"""The SGLang release the adapter is written and checked against.

Its own module so that the package can name it without importing ``wheel``: ``python -m
ulakv.integrations.sglang.wheel`` (``make test``'s set-up) would otherwise find that module already
imported by the package and run it twice over.
"""

SGLANG_VERSION = "0.5.23"
