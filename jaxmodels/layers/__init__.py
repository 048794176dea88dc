"""Pure-function building blocks shared by every family."""
