"""The trivial worker the launch benchmark starts: it does nothing."""
