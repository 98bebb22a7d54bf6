//! A component that implements some other world. The host must refuse to load
//! it as a runner or a tool, with a message that says what is missing.

wit_bindgen::generate!({
    inline: "
        package example:greeter;
        world greeter {
            export greet: func(name: string) -> string;
        }
    ",
});

struct Greeter;

impl Guest for Greeter {
    fn greet(name: String) -> String {
        format!("hello, {name}")
    }
}

export!(Greeter);
