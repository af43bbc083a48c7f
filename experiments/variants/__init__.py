"""Variants, one package per op (`dequant/`, ...); each file registers itself with experiments.registry on import."""
