"""The in-sandbox exec agent (PID 1 of every sandbox, written in C) and its host side.

``protocol`` encodes and decodes frames (no I/O), ``client`` listens for agents and
talks to them, ``build`` compiles the agent and stages the read-only ``/.dsec/bin``.
"""
