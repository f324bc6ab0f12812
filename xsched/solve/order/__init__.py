"""Order searches: candidate orders and the local search (`order`), and the searches the registry runs (`search`)."""
