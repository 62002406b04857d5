"""The varbench version (one home: the package root and the packaging metadata read it)."""

VERSION = "0.1.0"
