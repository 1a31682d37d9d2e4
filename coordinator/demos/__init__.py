"""Models and data the demo, the examples, the tests and the benchmarks share: the digits
classifier, a recommendation model and its synthetic data, the examples' helpers.

May import: everything of the coordinator below it (strategies, training).
"""

__all__: list[str] = []
