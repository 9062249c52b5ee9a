"""Compile side: the graph pass, its site finders (``patterns/``), the planner and the strategies.

Compile code builds graphs of ``weave`` ops (``weavepass.ops``) and may ask the runtime whether it
can serve a site (support checks), but never writes runtime state.
"""
