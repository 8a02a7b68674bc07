"""Kernel implementations of the op families, one package per provider."""
