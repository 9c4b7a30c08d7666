"""The SGLang release the adapter is written and checked against.

Its own module, importing nothing: the plugin refuses another release with it, and the developer
tools (``tools.sglang_wheel``, which fetches this release's wheel for the tests) name it from here.
"""

SGLANG_VERSION = "0.5.23"
