"""Command-line options of the benchmarks."""


def pytest_addoption(parser):
    parser.addoption("--backend", default="tcp", choices=("tcp", "rdma"),
                     help="transfer backend for bench_transfer.py (rdma: a NIC, or PDDCORE_VERBS=emulator)")
