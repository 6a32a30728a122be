"""Hosting the platform: the embedded stack of one machine (`dsec up`), its
supervisor, and the control and node hosts of a deployment across machines."""
