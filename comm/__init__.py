"""Dispatch/combine between attention ranks and expert owners (two-stage and direct).

Usable without the rest of the engine. Not built yet: see the README's roadmap.
"""
