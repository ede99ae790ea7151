/*
 * backend_name_rss.c - what loading libshadowkv costs a program that never asks for
 * cuda: it calls skv_backend_name() only; with an argument it also asks whether cuda
 * is available (which opens the cuda plugin and its CUDA libraries).
 *
 *   make install PREFIX=$PWD/build/stage
 *   cc -Ibuild/stage/include bench/tools/backend_name_rss.c -Lbuild/stage/lib -lshadowkv -o build/bn
 *   LD_LIBRARY_PATH=build/stage/lib /usr/bin/time -f "rss %M KB, %e s" build/bn [cuda]
 */
#include <stdio.h>

#include <shadowkv.h>

int main(int argc, char **argv)
{
    (void)argv;
    printf("%s\n", skv_backend_name(SKV_BACKEND_CPU));
    if (argc > 1)
        printf("cuda: %s (%s)\n", skv_status_string(skv_backend_available(SKV_BACKEND_CUDA)), skv_last_error());
    return 0;
}
