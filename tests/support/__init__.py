"""What the tests and the benchmarks share, and nothing the product imports: a real daemon for
a test (`harness`), random-weight model directories (`random_model`), a fake engine speaking the
real protocol (`fake_engine`), and the fuzz generators (`fuzz_requests`). Tests import it as
`support` (pytest puts tests/ on the path); benchmarks add tests/ to `sys.path` first."""
