"""`dtrain`'s command line: `main` (the console script: runs, plan, backtest, guide, capstone),
`runs` (`dtrain runs`) and `capstone` (`dtrain capstone`)."""
