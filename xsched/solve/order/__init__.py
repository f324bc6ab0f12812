"""Order searches: starting orders, moves and the search itself (`order`), and the two methods built on it:
`order-gaps` (`gaps`) and `order-cpsat` (`cpsat`)."""
