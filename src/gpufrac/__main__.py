from gpufrac.cli import main

main()
