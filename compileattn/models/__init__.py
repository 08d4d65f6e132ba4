"""Small decoder families (random weights) that drive the compiler in tests, benchmarks and the demo."""
