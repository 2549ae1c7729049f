"""On the device: CUDAPrefetcher, its CUDA graphs, DALILoader."""
