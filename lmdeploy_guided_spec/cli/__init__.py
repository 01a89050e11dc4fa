"""The ``lmdeploy-guided-spec`` command line (:mod:`.commands`) and its ``check`` and ``demo`` commands.

It sits on top: it imports the series tooling, the CPU path and the test and demo support; none of them imports it.
"""
from .commands import main

__all__ = ['main']
