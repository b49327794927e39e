from pulsediff.cli.main import main

main()
