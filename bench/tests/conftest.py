"""pytest settings of bench/tests."""


def pytest_configure(config):
    config.addinivalue_line("markers", "mlx: runs bench/mlx_peer.py on mlx and mlx-lm")
