from retrain.cli import main

main()
