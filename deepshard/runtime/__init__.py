"""The runtime layer: what workers run. Imports torch."""
