//! `invoices-tool`: the example agent's read tool. `lookup_invoice` answers
//! from a small built-in book of invoices (it needs no grant).

use dex::agents::types::ToolEffect;
use serde::Deserialize;
use serde_json::json;

wit_bindgen::generate!({ path: "../../wit", world: "dex:agents/tool" });

struct InvoicesTool;

/// (number, payee, amount in cents, currency, status)
const INVOICES: &[(u64, &str, u64, &str, &str)] = &[
    (7, "Acme Paper", 12_000, "EUR", "open"),
    (8, "Northwind Freight", 48_050, "EUR", "open"),
    (9, "Blue Harbour Cafe", 2_340, "EUR", "paid"),
];

#[derive(Deserialize)]
struct LookupArgs {
    invoice: u64,
}

impl Guest for InvoicesTool {
    fn list_tools() -> Vec<ToolSpec> {
        vec![ToolSpec {
            name: "lookup_invoice".to_string(),
            description: "Looks up an invoice by number: payee, amount and status.".to_string(),
            parameters_schema: r#"{"type":"object","properties":{"invoice":{"type":"integer","description":"The invoice number"}},"required":["invoice"]}"#.to_string(),
            effect: Some(ToolEffect::Read),
        }]
    }

    fn call(call: DeferredToolExecution) -> Result<String, ToolError> {
        if call.tool_call.tool_name != "lookup_invoice" {
            return Err(ToolError::Execution(format!(
                "invoices-tool has no tool {:?}",
                call.tool_call.tool_name
            )));
        }
        let args: LookupArgs = serde_json::from_str(&call.tool_call.arguments).map_err(|err| {
            ToolError::Execution(format!(
                "arguments must be {{\"invoice\": <number>}}: {err}"
            ))
        })?;
        let (number, payee, cents, currency, status) = INVOICES
            .iter()
            .find(|i| i.0 == args.invoice)
            .ok_or_else(|| ToolError::Execution(format!("there is no invoice {}", args.invoice)))?;
        Ok(json!({
            "invoice": number,
            "payee": payee,
            "amount": *cents as f64 / 100.0,
            "currency": currency,
            "status": status,
        })
        .to_string())
    }
}

export!(InvoicesTool);
