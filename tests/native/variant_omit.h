/* The entry points a variant of the fake driver lacks ("name,name"): defined by the variant's own
 * small object (tests/native/Makefile, target `variant`), so the driver's code compiles once. */
extern const char fake_omit_list[];
