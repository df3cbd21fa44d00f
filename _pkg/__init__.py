"""mlxd: a local LLM serving daemon on MLX. The code lives in the top-level folders daemon/,
proxy/, engine/, storage_worker/ and protocol/, installed as mlxd.daemon, mlxd.proxy, ..."""

__version__ = "0.1.0"
